module github.com/sonar-moe/sonar

go 1.26.8

require (
	github.com/pebbe/zmq4 v1.4.0
	github.com/vmihailenco/msgpack/v5 v5.4.1
	go.uber.org/zap v1.28.0
	golang.org/x/sys v0.50.0
)

require (
	github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
	go.uber.org/multierr v1.10.0 // indirect
	gonum.org/v1/gonum v0.17.0 // indirect
)
