"""The client's side of verifying untrusted servers (the map of all of it: :mod:`shoal.verify`):
audit mode and its counters (:mod:`.audit`), a session's auditors and the settling of disputes
(:mod:`.auditors`), ``generate`` repaired after a lie (:mod:`.repair`), and testimony to the judges
(:mod:`.witness`)."""
