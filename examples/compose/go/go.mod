module example.com/floodgate/goapp

go 1.19
