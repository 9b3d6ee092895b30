package main

import (
	"fmt"

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
