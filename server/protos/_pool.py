"""Kiln's private protobuf descriptor pool (see tools/gen_protos.py for why it is not the default pool)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
