"""The HTTP front end: KServe V2 (with Triton's binary tensor and shared-memory extensions),
MLflow's scoring protocol and Prometheus over HTTP/1.1, on the event loop, uvloop's where installed.

    front_end.py   the listening socket, what every connection shares, shutdown
    connection.py  one connection: heads parsed by llhttp (httptools), bodies received straight into
                   the memory their route gives them, answers in order, deadlines
    bodies.py      where a body goes as it arrives (a V2 binary request's inputs: straight into
                   their arrays)
    routes.py      the route table and a plain function per route
    wire.py        requests and responses as the routes see them
"""
