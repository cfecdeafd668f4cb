"""A model's weights, peer to peer: givers answer from their files (:mod:`.give`); a joining server
fetches its span in verified chunks (:mod:`.fetch`, :mod:`.partial`, :mod:`.join`)."""
