"""omni-chat: the command (main.py), the loop (loop.py), the slash commands (commands.py), saved
conversations (transcript.py), /listen's meter (meter.py) and the input history (history.py)."""
