package ipc

// Shutdown is the optional body of a shutdown request: the secret that
// makes the caller the server's owner or operator (sonard --admin-token-file;
// a private server's owner wrote that file). Without the right token a
// shutdown request is refused.
type Shutdown struct {
	Token string `msgpack:"token"`
}
