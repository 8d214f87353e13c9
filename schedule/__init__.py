"""Dynamic KV budget schedule (issue 14, after Sparrow): pure planning (``plan``) from probe
agreement tables and a decode cost model (``cost``) measured on the engine in use."""
