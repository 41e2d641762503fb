"""Decoding: the loop (:mod:`.loop`), exact acceptance (:mod:`.verify`), the sampling
distribution (:mod:`.sampling`) and untrusted drafts made safe (:mod:`.untrusted`)."""
