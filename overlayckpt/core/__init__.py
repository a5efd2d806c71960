"""The overlay core in plain Python: lower, trees, overlay, journal, timeline, apply,
maintenance. No pyfuse3, no service."""
