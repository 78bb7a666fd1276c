"""Rollout servers: generation in processes (and machines) of their own. The wire format both ends
share (wire.py), the server's decode loop (decode.py) and HTTP app (server.py), both ends of the
weight push (weights.py), and the trainer's client of N servers (client.py, placement.py)."""
