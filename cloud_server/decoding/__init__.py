"""Sessions and their one decode loop: prefill, the forwards each builds, acceptance and
commit, pacing, server-side decoding, and the batcher that runs the sessions' forwards together."""
