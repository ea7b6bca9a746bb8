"""specdraft client: the CLI now; typed gRPC clients come with the service (issue 3)."""
