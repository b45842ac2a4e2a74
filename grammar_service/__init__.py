"""Grammar service: compiles constraints with llguidance and serves per-step token masks over gRPC."""
