"""Generated protobuf code; import only through weightsync.coordinator.serde."""
