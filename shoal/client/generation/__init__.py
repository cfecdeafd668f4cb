"""What the client model adds to transformers' generation: speculative decoding with shoal's window
planner (:mod:`.speculation`), drafters kept in step with the sequence (:mod:`.drafters`), and
position-seeded sampling that a repaired generation reproduces (:mod:`.sampling`)."""
