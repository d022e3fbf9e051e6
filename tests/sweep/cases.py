"""
The sweep's cases, enumerated from the libraries themselves (never a hand-picked list): one per model class of
transformers' auto mappings (hf.py), per family of timm's models, per diffusers model class, per torchvision
classification model (others.py). A library that is not installed gives one NOT-BUILDABLE case saying so.

    all_cases(library=None)   [Case] in a fixed order
    by_id()                   {case id: Case}
"""

import dataclasses
import functools
from typing import Callable, Dict, List, Optional

from sweep import hf, others

SECONDS = 600  # a case's time limit


@dataclasses.dataclass(frozen=True)
class Case:
    library: str
    task: str
    key: str  # the model type (transformers), family (timm) or module name
    name: str  # the model class (or timm model name)
    prepare: Callable = dataclasses.field(compare=False, repr=False)
    seconds: int = SECONDS

    @property
    def id(self) -> str:
        return f"{self.library}/{self.task}/{self.key}/{self.name}"

    def row(self) -> Dict[str, str]:
        return dict(id=self.id, library=self.library, task=self.task, key=self.key, name=self.name)


def _transformers_cases():
    return [
        Case("transformers", task, model_type, name, functools.partial(hf.prepare, task, model_type, name))
        for task, model_type, name in hf.cases()
    ]


LIBRARIES = {
    "transformers": _transformers_cases,
    "timm": others.timm_cases,
    "diffusers": others.diffusers_cases,
    "torchvision": others.torchvision_cases,
}


@functools.lru_cache(maxsize=None)
def _all(library: Optional[str]) -> List[Case]:
    found = []
    for name, make in LIBRARIES.items():
        if library in (None, name):
            found += make(Case) if name != "transformers" else make()
    return found


def all_cases(library: Optional[str] = None) -> List[Case]:
    return list(_all(library))


def by_id() -> Dict[str, Case]:
    return {case.id: case for case in _all(None)}
