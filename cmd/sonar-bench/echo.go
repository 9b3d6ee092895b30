package main

import (
	"fmt"
	"net"

	zmq "github.com/pebbe/zmq4"
)

// echo serves a bare ZeroMQ ROUTER on addr that sends every message back
// unchanged, until it is killed: the floor of a request's round trip over
// the same transport sonard uses, with no decoding and no handler
// (bench/kernel.py measures it next to sonard's round trip).
func echo(addr string) error {
	s, err := zmq.NewSocket(zmq.ROUTER)
	if err != nil {
		return fmt.Errorf("echo socket: %w", err)
	}
	defer s.Close()
	if err := s.Bind(addr); err != nil {
		return fmt.Errorf("echo bind %s: %w", addr, err)
	}
	fmt.Println("ready") // the caller connects after this line
	for {
		msg, err := s.RecvMessageBytes(0)
		if err != nil {
			return fmt.Errorf("echo recv: %w", err)
		}
		if _, err := s.SendMessage(msg); err != nil {
			return fmt.Errorf("echo send: %w", err)
		}
	}
}

// unixEcho serves a plain Unix seqpacket socket at path that sends every
// message back, until it is killed: the same request, Go process and Python
// client as echo, without ZeroMQ (no I/O threads, one kernel hop each way),
// which is the floor of any transport on this machine.
func unixEcho(path string) error {
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("unix echo listen %s: %w", path, err)
	}
	defer l.Close()
	fmt.Println("ready")
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			return fmt.Errorf("unix echo accept: %w", err)
		}
		go func() {
			defer c.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if err != nil || n == 0 {
					return
				}
				if _, err := c.Write(buf[:n]); err != nil {
					return
				}
			}
		}()
	}
}
