"""What the engine tells about itself: statistics, Prometheus metrics, step events, live state."""
