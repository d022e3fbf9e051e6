"""
The analysis's command lines (cli.py, plots.py) parse their arguments with `Parser`, argparse made to return
instead of exiting: --help and a bad argument become main()'s return code (0 and 2, argparse's), so that no
module of the package exits its caller's process (a notebook calling main() keeps running).

    parser = Parser(prog_name(argv, "gns-analysis.py"), description=...)
    args = parser.parse(argv)          # the namespace, or an int: the code main() returns (help or usage printed)
"""

import argparse
import os
import sys


class _Done(Exception):
    """argparse wanted to exit (after --help, or a usage error it printed): the status to return."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose parse() returns the status argparse would have exited with."""

    def exit(self, status=0, message=None):
        if message:
            self._print_message(message, sys.stderr)
        raise _Done(status)

    def parse(self, argv=None):
        try:
            return self.parse_args(argv)
        except _Done as done:  # raised by exit() above, caught here: never leaves this module
            return done.status


def prog_name(argv, script):
    """The name a command's messages start with: the program run (`nanogns-analysis` when installed, the script in
    the checkout) when main() reads the command line, else `script` (a call from Python with its arguments)."""
    return os.path.basename(sys.argv[0]) if argv is None and sys.argv and sys.argv[0] else script
