"""Typed messages and zmq channels between the server's processes (main, scheduler, detokenizer)."""
