//! AsyncRead/AsyncWrite over a pipe (being built).
