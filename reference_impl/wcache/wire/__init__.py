"""The wire between daemon and engine: JSON frames, sockets, arenas and their transports, the hand-back.

Deliberately empty of re-exports, so importing the frame format stays cheap (no torch)."""
