"""The Events extension (SEP-3415): what `events/*` answer, the webhook deliveries and the watches of the legacy
server's changes. Sits beside tasks/ and legacy/: imports tasks' facade and store, never the front or the edge."""
