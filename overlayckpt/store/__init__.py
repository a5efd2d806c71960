"""The store, the only layer that imports lmdb: the environment and its transactions, the
store format and its upgrade, the synced-snapshot record and what to trust after a crash,
salvage, session.json."""
