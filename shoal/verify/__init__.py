"""Verifying untrusted peers. This package holds the pure parts (no I/O): comparing two servers'
outputs within the honest tolerance (:mod:`.compare`), signed step receipts (:mod:`.receipts`), the
chain of a session's cache inputs they commit to (:mod:`.state`), and evidence of a lie, built and
checked (:mod:`.evidence`).

Where the rest of verification lives, by who runs it:

    client  shoal/client/verification/
              audit.py      modes (audit, redundant), counters, LieDetected, UnsettledDispute
              auditors.py   a session's auditors: replicas re-run its hops, disputes are settled
                            (or, unsettled, both sides routed around)
              repair.py     generate rolls back to a lie and regenerates; hold_back streamers
              witness.py    testimony: evidence of a caught liar sent to the judges
            shoal/client/remote/sequence.py  receipts of stateless forwards checked
            shoal/client/remote/driver.py    receipts of session steps and pushes checked
    server  shoal/server/judge.py      judges evidence against another server of its blocks
            shoal/server/handler.py    signs receipts, keeps each session's state chain
    swarm   shoal/swarm/verdicts.py    signed verdicts and the quorum that convicts
            shoal/swarm/records.py     the verdict record
"""

from shoal.verify.compare import Tolerance, discrepancy, first_disagreement, row_discrepancy, tolerance_for
from shoal.verify.receipts import (
    Equivocation,
    Receipt,
    ReceiptError,
    ReceiptSigner,
    sign_receipt,
    signed_by,
    tensor_digest,
    verify_receipt,
)

__all__ = [
    "Equivocation",
    "Receipt",
    "ReceiptError",
    "ReceiptSigner",
    "Tolerance",
    "discrepancy",
    "first_disagreement",
    "row_discrepancy",
    "sign_receipt",
    "signed_by",
    "tensor_digest",
    "tolerance_for",
    "verify_receipt",
]
