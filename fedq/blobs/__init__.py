"""Blob stores for weights: safetensors bytes under keys, each read checked by sha256."""

from fedq.blobs.base import BlobRef, BlobStore
from fedq.blobs.factory import open_store, store_for
from fedq.blobs.keys import global_key, state_key, step_key, update_key

__all__ = ["BlobRef", "BlobStore", "global_key", "open_store", "state_key",
           "step_key", "store_for", "update_key"]
