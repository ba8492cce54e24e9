"""Daemon side: `wcache preload` (launcher), one daemon per device rank (rank), autotune-cache seeding."""
