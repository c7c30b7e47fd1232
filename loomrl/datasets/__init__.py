"""Webdataset prompt shards: the demo generator, writer and reader."""
