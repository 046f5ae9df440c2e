"""Streams: reading a stream's units, packing and shifting its rows into chunks, its saved state;
the text, mixture and replay kinds (``kinds.open_stream``)."""
