"""Files on disk: checkpoint reading (with release-format decoding), writing tiny / synthetic
checkpoints, storage codecs of released checkpoints, atomic writes and safe loads."""
