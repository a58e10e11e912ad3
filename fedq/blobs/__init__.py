"""Blob stores for weights: safetensors bytes under keys, each read checked by sha256."""

from fedq.blobs.base import BlobRef, BlobStore, sha256_hex
from fedq.blobs.factory import open_store
from fedq.blobs.keys import global_key, update_key

__all__ = ["BlobRef", "BlobStore", "open_store", "sha256_hex", "global_key", "update_key"]
