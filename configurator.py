"""
Poor Man's Configurator (nanoGPT's, with clear errors). train.py runs it with
`exec(open('configurator.py').read())`, so it reads and writes train.py's globals:

$ python train.py config/train_shakespeare_char.py --batch_size=32 --cos_attn=[1]

A positional argument is a config file: Python assignments, run with the current
config in scope and applied in order. `--key=value` overrides one key; the value
is parsed with ast.literal_eval (numbers, bools, lists), else kept as a string.
Every key must already be a config global of train.py and keep its type (an int
may stand in for a float). Mistakes end the run with a one-line message: a config file
that does not parse or fails as it runs (a name it does not define) is named with its line.
Names starting with `_` here and in config files are scratch, not config.
"""

import builtins as _builtins
import difflib
import os
import sys
import traceback as _traceback
from ast import literal_eval

_config_types = (int, float, bool, str, list, type(None))
_config_keys = sorted(k for k, v in globals().items()
                      if not k.startswith('_') and k != 'config_keys' and isinstance(v, _config_types))


_print = print if int(os.environ.get('RANK', 0)) == 0 else (lambda *args, **kwargs: None)  # under torchrun: rank 0 only


def _fail(message):  # every rank exits; rank 0 alone says why (see train.py's fail)
    if int(os.environ.get('RANK', 0)) != 0:
        sys.exit(0)
    sys.exit(f"configurator: {message}")


def _checked(key, value, source):
    """`value` for `key` if the key exists and the type fits; otherwise exit saying why."""
    if key not in _config_keys:
        close = difflib.get_close_matches(key, _config_keys, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        _fail(f"unknown config key {key!r} (from {source}); {hint}valid keys: {', '.join(_config_keys)}")
    default = globals()[key]
    if default is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:
        return float(value)
    _fail(f"config key {key!r} (from {source}) expects {type(default).__name__} like its default "
          f"{default!r}, got {type(value).__name__} {value!r}")


for _arg in sys.argv[1:]:
    if not _arg.startswith('--'):
        if '=' in _arg:
            _fail(f"{_arg!r} is not a config file; overrides are written --{_arg}")
        if not os.path.isfile(_arg):
            _fail(f"config file {_arg!r} not found (relative paths start at {os.getcwd()})")
        _print(f"Overriding config with {_arg}:")
        try:
            with open(_arg, encoding='utf-8') as _f:
                _source = _f.read()
            _code = _builtins.compile(_source, _arg, 'exec')  # (train.py's config has a `compile` of its own)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as _e:  # ValueError: a NUL byte
            _where = f"{_arg}, line {_e.lineno}" if isinstance(_e, SyntaxError) and _e.lineno else _arg
            _fail(f"config file {_where}: {type(_e).__name__}: {getattr(_e, 'msg', None) or _e}")
        _print(_source)
        _scope = {k: globals()[k] for k in _config_keys}
        try:
            exec(_code, _scope)
        except Exception as _e:  # a name it does not define, an import it lacks, ...: the file and line, one line
            _line = next((f.lineno for f in reversed(_traceback.extract_tb(_e.__traceback__))
                          if f.filename == _arg), '?')
            _fail(f"config file {_arg}, line {_line}: {type(_e).__name__}: {_e}")
        for _key, _value in _scope.items():
            if not _key.startswith('_') and not isinstance(_value, type(sys)):  # skip scratch names and imports
                globals()[_key] = _checked(_key, _value, _arg)
    else:
        _key, _eq, _text = _arg[2:].partition('=')
        if not _eq:
            _fail(f"{_arg!r} has no value; write --{_key}=VALUE (one argument, no spaces)")
        try:
            _value = literal_eval(_text)
        except (SyntaxError, ValueError):
            _value = _text  # a plain string, e.g. --device=cuda:1
        if isinstance(globals().get(_key), str):
            _value = _text  # string keys take the text as typed, e.g. --wandb_run_name=2024
        _value = _checked(_key, _value, _arg)
        _print(f"Overriding: {_key} = {_value!r}")
        globals()[_key] = _value
