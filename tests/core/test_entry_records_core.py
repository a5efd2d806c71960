"""What C publishes of a listing (fastpath.publish_dir's records) is what Python
answers: attrs.entry_record packs straight from a node, byte for byte what
fastpath's packing of entry_attrs gives, over random and extreme attributes."""
from __future__ import annotations

import random
import stat

from overlayckpt.fuse import fastpath
from overlayckpt.fuse.attrs import entry_attrs, entry_record
from overlayckpt.records import Node

EDGES = [0, 1, 511, 512, 513, (1 << 32) - 1, (1 << 62) - 1]
TIMES = [0, 1, 999_999_999, 1_000_000_000, -1, -1_000_000_001, 1_700_000_000_123_456_789]


def test_a_record_is_what_the_attributes_pack_to() -> None:
    rng = random.Random(20261205)
    modes = [stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777,
             stat.S_IFCHR | 0o600, stat.S_IFREG | 0o4755]
    for _ in range(5000):
        node = Node(rng.choice(modes), rng.randrange(1 << 32), rng.randrange(1 << 32),
                    rng.choice(EDGES + [rng.randrange(1 << 40)]),
                    rng.choice(TIMES + [rng.randrange(-(1 << 60), 1 << 60)]),
                    rng.choice(TIMES), rng.choice(TIMES),
                    rng.choice([-1, 0, 1, 2, (1 << 32) - 1]), rng.randrange(1 << 32))
        ino, bs = rng.randrange(1, 1 << 63), rng.choice([4096, 65536])
        assert entry_record(ino, node, bs) == fastpath._entry_out(entry_attrs(ino, node, bs)), node
