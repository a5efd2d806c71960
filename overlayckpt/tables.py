"""The names of the LMDB tables and of the meta keys: spelled here once, used by name.

docs/design.md ("On-disk schema") gives the meaning of every key and value.
Imports nothing of ours (rank 0, next to records.py).
"""
from __future__ import annotations

# tables
META = b"meta"          # small values under the keys below
BLOCKS = b"blocks"      # content hash -> block (compressed or raw)
NODES = b"nodes"        # inode -> Node
DIRENTS = b"dirents"    # parent inode + name -> child inode (or a whiteout)
BMAP = b"bmap"          # inode + block index -> content hash
XATTRS = b"xattrs"      # inode + name -> value
JOURNAL = b"journal"    # seq -> JournalRecord
CKPTS = b"ckpts"        # checkpoint id -> Checkpoint
NAMES = b"names"        # checkpoint name -> checkpoint id
PINNED = b"pinned"      # repo path -> what apply pinned
CONV = b"conv"          # conversation line key -> entry
SEEN = b"seen"          # repo file -> what the session first saw of it: the baseline (core/baseline.py)
# the history index (core/history.py): derived from the journal, rebuilt when missing
VERSIONS = b"versions"  # versioned key + seq -> the key's value before that group changed it
CHANGED = b"changed"    # layer + seq + versioned key -> born seq or b"": each key's newest version
# each group's net file changes (core/groupfiles.py): derived too
GROUPFILES = b"groupfiles"  # group start seq + path -> its net change in the group (+ NUL: counts)

HISTORY_TABLES = (VERSIONS, CHANGED)
DERIVED_TABLES = (*HISTORY_TABLES, GROUPFILES)  # bundles and salvage leave these out
TABLES = (META, BLOCKS, NODES, DIRENTS, BMAP, XATTRS, JOURNAL, CKPTS, NAMES, PINNED, CONV, SEEN,
          *DERIVED_TABLES)
# the live tree: every key of these begins with the inode whose attributes, names,
# content or xattrs it holds
LIVE_TABLES = (NODES, DIRENTS, BMAP, XATTRS)

# keys in META
FORMAT_KEY = b"format"            # store format version
BLOCK_SIZE_KEY = b"block_size"    # the session's block size
BLOCK_BYTES_KEY = b"block_bytes"  # bytes held in BLOCKS
SEQ_KEY = b"seq"                  # the next journal seq
GROUP_KEY = b"group"              # the open automatic group
NEXT_INO_KEY = b"next_ino"        # counter of upper inodes
NEXT_CKPT_KEY = b"next_ckpt"      # counter of checkpoint ids
CONV_HEAD_KEY = b"conv_head"      # the live conversation's last line
CONV_NEXT_KEY = b"conv_next"      # counter of conversation lines
WRITE_BEHIND_KEY = b"write_behind"  # how far the write-behind log (writebehind.py) has been stored
REMOVALS_KEY = b"removals"  # the last record of the removal log (answered.py) stored
REPO_KEY = b"repo"                # the repo's absolute path, should session.json be lost
HISTORY_KEY = b"history"          # present when the history index matches the journal
HISTORY_BORN = 2                  # its value once CHANGED has layers and born values (format 5)
GROUPFILES_KEY = b"groupfiles"    # present when GROUPFILES matches the journal
DERIVED_KEYS = (HISTORY_KEY, GROUPFILES_KEY)  # absent: the derived tables are rebuilt at open
APPLIED_KEY = b"applied"          # the journal position the repo was last applied at
RESTORE_FILES_KEY = b"restore_files/"  # + seq: a restore's record still to list its files
RESTORED_KEY = b"restored"        # u64 id of the last whole restore's checkpoint, then the
                                  # u64 inodes it left as they are that its target had made:
                                  # the live state is its target's since, but for those, the
                                  # inodes made after the target and what was journaled
                                  # after it (core/delta.py rows_near)
RESTORED_LEFT_MOST = 1024         # a restore that leaves more inodes leaves no such mark
UNDER_KEY = b"under/"             # + checkpoint id: u64 id of the checkpoint before it, whose
                                  # command its own ran under (an agent's git commit: core/folds.py)
PARENT_KEY = b"parent"            # a fork's parent: msgpack [parent store path, checkpoint id]
FORK_KEY = b"fork/"               # + a fork's store path: u64 checkpoint id it forked from
