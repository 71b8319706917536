"""Shared test helpers: one draft-server launcher, one port helper, one step builder, a bare wire client."""
