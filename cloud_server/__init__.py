"""The cloud server, in three places: `engine/` runs the target's forwards (behind one
interface), `decoding/` holds the sessions and their decode loop, and `rpc/` is the gRPC
surface. `target.py` is the model as sessions see it; `cli.py` starts it all."""
