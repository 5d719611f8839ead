"""The ground floor: where things live (paths), atomic file writes, content hashes and
progress lines. Imports nothing else from mm_assets; every other floor may use it."""
