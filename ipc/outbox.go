package ipc

import (
	"fmt"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"
)

// Flow control. ZeroMQ queues at most SNDHWM (1000) messages for one peer;
// past that a ROUTER drops them, or, with ZMQ_ROUTER_MANDATORY (set by
// Listen), says EAGAIN. A reply that finds no room waits in its client's
// outbox, and while it waits the client's next requests are parked, not
// executed: the client is slowed down to the pace at which it reads its
// replies (backpressure). Beyond the parking limits a request is answered,
// without being executed, by a "busy" error (the client is told); beyond
// maxWaiting replies a client that reads nothing loses its requests, each one
// logged.
//
// Every reply is small: error texts are clipped (package clip, MaxErrorBytes)
// and no reply body echoes a request's data, so SNDHWM, which counts messages,
// bounds the bytes libzmq holds for a client too (1000 replies of at most a
// few KiB), and the outbox counts its replies' bytes besides (maxWaitingBytes).
const (
	maxParked       = 1024
	maxParkedBytes  = 64 << 20
	maxWaiting      = 1 << 16
	maxWaitingBytes = 32 << 20
)

// outbox is what waits for one client: replies without room yet, then
// requests received after them (executed, in order, once the replies went).
type outbox struct {
	replies     [][][]byte
	replyBytes  int // of replies
	parked      [][][]byte
	parkedBytes int
}

func size(frames [][]byte) int {
	n := 0
	for _, f := range frames {
		n += len(f)
	}
	return n
}

// queue adds a reply behind the waiting ones.
func (ob *outbox) queue(frames [][]byte) {
	ob.replies = append(ob.replies, frames)
	ob.replyBytes += size(frames)
}

// sent drops the first waiting reply.
func (ob *outbox) sent() {
	ob.replyBytes -= size(ob.replies[0])
	ob.replies[0] = nil
	ob.replies = ob.replies[1:]
}

// park queues a request of client behind its waiting replies.
func (ob *outbox) park(t *Transport, client string, frames [][]byte) {
	n := size(frames)
	switch {
	case len(ob.parked) < maxParked && ob.parkedBytes+n <= maxParkedBytes:
		ob.parked = append(ob.parked, frames)
		ob.parkedBytes += n
	case len(ob.replies) < maxWaiting && ob.replyBytes < maxWaitingBytes:
		ob.queue(t.busy(frames, len(ob.replies)))
	default:
		t.log.Warn("client reads no replies: request dropped unexecuted", zap.String("client", client),
			zap.Int("waiting_replies", len(ob.replies)), zap.Int("waiting_bytes", ob.replyBytes))
	}
}

// busy is the reply to a request that was not executed because its client
// has too many replies waiting.
func (t *Transport) busy(frames [][]byte, waiting int) [][]byte {
	head := [][]byte{frames[0]}
	rest := frames[1:]
	if len(rest) >= 2 && len(rest[0]) == 0 {
		head = append(head, []byte{})
		rest = rest[1:]
	}
	var rep Reply
	if len(rest) == 1 {
		req, _ := DecodeRequest(rest[0])
		rep.ID = req.ID
	}
	rep.Error = fmt.Sprintf("busy: not executed: this client has %d replies it has not read and %d requests waiting; "+
		"read replies before sending more", waiting, maxParked)
	return t.replyFrames(head, rep)
}

// send sends a reply to client, or queues it behind the client's waiting
// replies. A client that is gone (EHOSTUNREACH) cannot be told anything.
func (t *Transport) send(client string, frames [][]byte) {
	if ob := t.out[client]; ob != nil {
		ob.queue(frames)
		return
	}
	switch t.trySend(client, frames) {
	case sendFull:
		ob := &outbox{}
		ob.queue(frames)
		t.out[client] = ob
	case sendGone:
		delete(t.out, client)
	}
}

type sendResult int

const (
	sent sendResult = iota
	sendFull
	sendGone
)

func (t *Transport) trySend(client string, frames [][]byte) sendResult {
	parts := make([]any, len(frames))
	for i, f := range frames {
		parts[i] = f
	}
	_, err := t.sock.SendMessageDontwait(parts...)
	switch {
	case err == nil:
		return sent
	case zmq.AsErrno(err) == zmq.Errno(11): // EAGAIN: the client's queue is full
		return sendFull
	case zmq.AsErrno(err) == zmq.EHOSTUNREACH:
		t.log.Debug("reply not sent: client gone", zap.String("client", client))
		return sendGone
	}
	t.log.Warn("reply not sent", zap.String("client", client), zap.Error(err))
	return sent
}

// flush sends waiting replies and serves one parked request of each client
// whose replies all went. It reports whether work is left.
func (t *Transport) flush(h Handler) bool {
	for client, ob := range t.out {
		for len(ob.replies) > 0 {
			r := t.trySend(client, ob.replies[0])
			if r == sendFull {
				break
			}
			ob.sent()
			if r == sendGone {
				ob.replies, ob.parked, ob.replyBytes = nil, nil, 0
			}
		}
		if len(ob.replies) == 0 && len(ob.parked) > 0 {
			req := ob.parked[0]
			ob.parked[0] = nil
			ob.parked = ob.parked[1:]
			for _, f := range req {
				ob.parkedBytes -= len(f)
			}
			rep := t.serveOne(h, client, req, Monotonic()) // parked: received now, as far as its reply says
			switch t.trySend(client, rep) {
			case sendFull:
				ob.queue(rep)
			case sendGone:
				ob.parked = nil
			}
		}
		if len(ob.replies) == 0 && len(ob.parked) == 0 {
			delete(t.out, client)
		}
	}
	return len(t.out) > 0
}
