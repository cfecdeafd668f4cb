"""The wide-area network emulator (testkit.wan)."""
