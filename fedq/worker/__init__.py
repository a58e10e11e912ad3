"""The training side: one client update (fetch, shard, train, upload), the local
training loop, hardware classes and checks, and what a worker does when it starts.
A worker needs the broker and the blob store, never the database."""
