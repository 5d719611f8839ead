"""Assets: thin wiring of resources and storage to the domain modules, one file per stage."""
