"""Research and measurement: the bench, DISCO's data/training/tuning and the router's
collection/training/reports. The lab imports the runtime; the runtime never imports the lab
(tests/test_layout.py)."""
