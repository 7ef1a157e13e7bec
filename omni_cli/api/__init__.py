"""The OpenAI-compatible HTTP API: protocol.py (request and response shapes, no torch), server.py (the
Starlette app omni-serve runs), client.py (what omni-say and omni-chat use to talk to a server)."""
