// benchmarks/grpc_floor: grpc's C++ callback server, as serving/grpc/native.cc runs it (a generic service, grpc's
// own threads), taking each call's one message in and answering a fixed message, and nothing else: no parsing, no
// copy, no model, no Python. benchmarks/ingest.py sends it the gRPC rows' requests, so that their CPU per request
// has a reference in the same run: what grpc itself costs on this machine to receive those bytes (as nginx is the
// binary HTTP rows' reference).
//
// grpc_floor PORT ANSWER_FILE [NAME=INT...]: serves on 127.0.0.1:PORT, answers every call with ANSWER_FILE's bytes
// (a serialized ModelInferResponse), with these integer channel arguments, prints "ready" once it listens. Built by benchmarks/ingest.py with grpc++'s pkg-config flags.
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <climits>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

namespace {

std::string answer;

class Call : public grpc::ServerGenericBidiReactor {
 public:
  Call() { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the call ended before its request message"));
      return;
    }
    grpc::Slice slice(answer.data(), answer.size());
    out_ = grpc::ByteBuffer(&slice, 1);
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
};

class Service : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override { return new Call(); }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: grpc_floor PORT ANSWER_FILE [NAME=INT...]" << std::endl;
    return 2;
  }
  std::ifstream file(argv[2], std::ios::binary);
  answer.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
  Service service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[1], grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(INT_MAX);
  builder.RegisterCallbackGenericService(&service);
  for (int i = 3; i < argc; i++) {
    std::string argument(argv[i]);
    size_t equals = argument.find('=');
    builder.AddChannelArgument(argument.substr(0, equals), std::stoi(argument.substr(equals + 1)));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    std::cerr << "grpc_floor: could not listen on 127.0.0.1:" << argv[1] << std::endl;
    return 1;
  }
  std::cout << "ready" << std::endl;
  server->Wait();
}
