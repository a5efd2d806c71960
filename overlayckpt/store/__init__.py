"""The store: the LMDB environment (the only lmdb importer), the synced-snapshot record, session.json."""
