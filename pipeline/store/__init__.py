"""Persistence: the request ledger (SQLite) and the model version store (directories with a
sha256 manifest). Nothing here knows how a removal is computed."""
from pipeline.store.ledger import Ledger, LedgerConflictError, LedgerError, SampleConflictError, TransitionError
from pipeline.store.versions import TamperedVersionError, VersionInfo, VersionStore, VersionStoreError

__all__ = [
    "Ledger", "LedgerConflictError", "LedgerError", "SampleConflictError", "TransitionError",
    "TamperedVersionError", "VersionInfo", "VersionStore", "VersionStoreError",
]
