package ipc

// conns ties ZeroMQ routing ids (clients) to the connections they arrived
// on. The ROUTER socket's monitor reports each accepted and each closed
// connection by file descriptor, and every message carries the descriptor it
// was read from (libzmq's "__fd" metadata, behind ZMQ_SRCFD). Descriptor
// numbers are reused, but the monitor's events are produced before the
// descriptor can be reused or a message of the new connection can be read,
// so draining the monitor before each message keeps the table exact.
type conns struct {
	byFD   map[int]*peer
	byName map[string]*peer
	// last is the client of the connection that last closed on a
	// descriptor: its messages may still be queued when a new connection
	// reuses the descriptor.
	last map[int]string
}

// peer is one accepted connection; client is its routing id once a message
// came from it (one ROUTER connection carries one routing id).
type peer struct {
	fd     int
	client string
	prev   string // the client of the previous connection on fd
}

func newConns() *conns {
	return &conns{byFD: map[int]*peer{}, byName: map[string]*peer{}, last: map[int]string{}}
}

// accepted records a new connection on fd; a connection still recorded on
// fd (its close was not reported) is returned as gone.
func (c *conns) accepted(fd int) (gone string) {
	gone = c.closed(fd)
	c.byFD[fd] = &peer{fd: fd, prev: c.last[fd]}
	delete(c.last, fd)
	return gone
}

// open is the number of open connections.
func (c *conns) open() int { return len(c.byFD) }

// silent says whether an open connection on fd has sent no message yet.
func (c *conns) silent(fd int) bool {
	p := c.byFD[fd]
	return p != nil && p.client == ""
}

// closed forgets the connection on fd and returns its client ("" when no
// message came from it).
func (c *conns) closed(fd int) string {
	p := c.byFD[fd]
	if p == nil {
		return ""
	}
	delete(c.byFD, fd)
	if p.client != "" && c.byName[p.client] == p {
		delete(c.byName, p.client)
	}
	if p.client != "" {
		c.last[fd] = p.client
	} else {
		delete(c.last, fd)
	}
	return p.client
}

// message says whether a message of client read from fd comes from an open
// connection (ok), and whether it is the first one. It does not when the
// connection on fd was closed (a message left in the socket's queue by a
// client that is gone) or belongs to another client (the descriptor was
// reused). A message left over by the previous connection on a reused
// descriptor can come before the new connection's first one and be taken for
// it; when the new client's message comes, the connection is given to it and
// the previous client is returned as gone (again).
func (c *conns) message(fd int, client string) (ok, first bool, gone string) {
	p := c.byFD[fd]
	switch {
	case p == nil:
		return false, false, ""
	case p.client == client:
		return true, false, ""
	case p.client == "":
	case p.client == p.prev:
		gone = p.client
		if c.byName[gone] == p {
			delete(c.byName, gone)
		}
		p.prev = ""
	default:
		return false, false, ""
	}
	p.client = client
	c.byName[client] = p
	return true, true, gone
}

// fd is the descriptor of client's open connection (false: none).
func (c *conns) fd(client string) (int, bool) {
	p := c.byName[client]
	if p == nil {
		return 0, false
	}
	return p.fd, true
}

// connected reports whether client has an open connection.
func (c *conns) connected(client string) bool { return c.byName[client] != nil }

// len is the number of open connections.
func (c *conns) len() int { return len(c.byFD) }
