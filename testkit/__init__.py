"""Test and benchmark support that must not live in product code: the fault seam (servers whose
behaviour is altered on purpose) and the wide-area network emulator. Imported by ``tests/`` and
``bench/``; not installed with shoal."""
