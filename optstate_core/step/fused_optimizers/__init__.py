"""The fused optimizers, one file each: state keys, eligibility, kernel and launch arguments.

* ``base.py``      what an entry declares (:class:`FusedOptimizer`) and a parameter's :class:`FusedPlan`
* ``registry.py``  the entries, and the one that steps an inner optimizer
* ``adam.py``, ``sgd.py``, ``lion.py``, ``schedule_free.py``  the entries (their kernels: ``step/kernels/``)
"""
from .base import FusedOptimizer, FusedPlan
from .registry import ENTRIES, entry_for, no_kernel

__all__ = ["FusedOptimizer", "FusedPlan", "ENTRIES", "entry_for", "no_kernel"]
