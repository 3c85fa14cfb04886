"""The command-line apps (demo, bench, plan): they use the public API; the core never imports them."""
