"""Verifying untrusted peers: comparing two servers' outputs within the honest tolerance (:mod:`.compare`)
and signed step receipts (:mod:`.receipts`)."""

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
