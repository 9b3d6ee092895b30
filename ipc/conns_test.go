package ipc

import "testing"

// The connection table follows the monitor's events and the descriptor of
// each message, descriptors being reused.
func TestConns(t *testing.T) {
	type step struct {
		op        string // "accept", "close", "msg"
		fd        int
		client    string
		ok, first bool   // msg
		gone      string // accept, close, msg
	}
	for _, c := range []struct {
		name  string
		steps []step
	}{
		{"one client", []step{
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true},
			{op: "msg", fd: 7, client: "a", ok: true},
			{op: "close", fd: 7, gone: "a"},
		}},
		{"a closed connection's leftover message", []step{
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true},
			{op: "close", fd: 7, gone: "a"},
			{op: "msg", fd: 7, client: "a"},
		}},
		{"descriptor reused by another client", []step{
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true},
			{op: "close", fd: 7, gone: "a"},
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "b", ok: true, first: true},
			{op: "msg", fd: 7, client: "a"}, // left over from the first connection
			{op: "close", fd: 7, gone: "b"},
		}},
		{"a leftover before the new client's first message", []step{
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true},
			{op: "close", fd: 7, gone: "a"},
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true}, // taken for the new connection's
			{op: "msg", fd: 7, client: "b", ok: true, first: true, gone: "a"},
			{op: "msg", fd: 7, client: "a"},
			{op: "msg", fd: 7, client: "b", ok: true},
			{op: "close", fd: 7, gone: "b"},
		}},
		{"a close never reported", []step{
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true},
			{op: "accept", fd: 7, gone: "a"},
		}},
		{"reconnect with the same routing id", []step{
			{op: "accept", fd: 7},
			{op: "msg", fd: 7, client: "a", ok: true, first: true},
			{op: "close", fd: 7, gone: "a"},
			{op: "accept", fd: 9},
			{op: "msg", fd: 9, client: "a", ok: true, first: true},
		}},
		{"a connection that sent nothing", []step{
			{op: "accept", fd: 7},
			{op: "close", fd: 7},
			{op: "close", fd: 7},
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cs := newConns()
			for i, s := range c.steps {
				switch s.op {
				case "accept":
					if g := cs.accepted(s.fd); g != s.gone {
						t.Fatalf("step %d: accepted gone %q, want %q", i, g, s.gone)
					}
				case "close":
					if g := cs.closed(s.fd); g != s.gone {
						t.Fatalf("step %d: closed gone %q, want %q", i, g, s.gone)
					}
				case "msg":
					if ok, first, gone := cs.message(s.fd, s.client); ok != s.ok || first != s.first || gone != s.gone {
						t.Fatalf("step %d: message ok %v first %v gone %q, want %v %v %q", i, ok, first, gone, s.ok, s.first, s.gone)
					}
				}
			}
		})
	}
	cs := newConns()
	cs.accepted(3)
	cs.message(3, "x")
	cs.closed(3)
	cs.accepted(3)
	cs.closed(3)
	if cs.len() != 0 || len(cs.byName) != 0 || len(cs.last) != 0 || cs.connected("x") {
		t.Errorf("state left after close: %d connections, %d names", cs.len(), len(cs.byName))
	}
}
