"""The traced estimator's tools: the ledger of live storages by component after every operator, and the
CUDA caching allocator's rules replayed on it. trainfit/traced.py runs the trainer's step through them."""

from trainfit.memory.traced.caching_allocator import CachingAllocator
from trainfit.memory.traced.ledger import StorageLedger, TimelinePoint, phase_listener, unsharded_component

__all__ = ["CachingAllocator", "StorageLedger", "TimelinePoint", "phase_listener", "unsharded_component"]
