// serving.grpc._native: grpc's C++ server as the transport of the KServe V2 gRPC front end.
//
// Why it exists: under grpc.aio a unary call costs the event loop's thread ~300 us, ~200 us of it grpc.aio's
// own Python layer (four or five completions, each a hop from grpc's poller thread), more than a whole binary
// HTTP request (~180 us). Here grpc's C++ callback API does the HTTP/2, the calls and their messages on grpc's
// own threads, without the GIL; the event loop learns of them in batches and only runs the handlers, which are
// serving/grpc/service.py's, the same ones grpc.aio runs (serving/grpc/native.py is the Python half).
//
// How the two sides meet:
//   - grpc's threads (the reactions below) append events to a queue and, when it was empty, write an eventfd
//     that the event loop watches (loop.add_reader): one wake-up for many events. They never take the GIL.
//   - The loop drains the queue (drain) and answers through start_read / write / finish / add_initial_metadata,
//     each a non-blocking grpc call on the call's reactor.
//   - A unary method's one message is read before its call is announced, so a unary call is one event in and
//     one call out. For the methods named streams at start, Python grants reads (credits): messages are read
//     one after another while credits last, each a READ event, so what arrives together is read together. A
//     method not named is UNIMPLEMENTED here, and never reaches Python.
//   - A call lives in `calls` from its reactor's creation to OnDone; every operation Python asks for looks the
//     call up there under `calls_mu`, so none reaches a reactor that grpc has finished with. A call's status is
//     claimed once (Claim): by Python's answer or status, or here when it is cancelled (OnCancel), so that no call
//     is left unfinished whatever its handler does. A stream with answers still queued is finished when the last
//     is written, or has failed (OnWriteDone): a cancelled call fails its write in flight, and grpc's Shutdown
//     cancels every call past its deadline, so that too always comes.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <grpc/support/log.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_builder.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

enum Kind { CALL = 0, READ = 1, WRITTEN = 2, CANCELLED = 3 };

// How a method's messages reach Python: a stream's are read on credits; a split method's (ModelInferRequest) arrive
// as the message without its raw_input_contents, which stay here, in grpc's own buffers, until Python says where
// they go (copy_raw): a 602 KB image is copied once, into the batch it runs in, not into a bytes object, then by
// the protobuf parser into another, then into the batch.
struct Method {
  bool stream = false;
  bool split = false;
};

struct Event {
  Kind kind;
  uint64_t call;
  bool ok = true;
  bool split = false;                                      // the message is a ModelInferRequest to split
  std::string method;                                      // CALL
  std::string peer;                                        // CALL: the client's connection (grpc's "ipv4:addr:port")
  std::vector<std::pair<std::string, std::string>> metadata;  // CALL
  grpc::ByteBuffer message;                                // CALL of a unary method, READ
  bool has_message = false;
};

class Call;

struct Bridge {
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::CallbackGenericService> service;
  std::unordered_map<std::string, Method> methods;  // full method name -> how its messages go
  int max_calls = 0;
  std::atomic<int> active{0};  // calls holding one of the max_calls shared places (see Slot)
  // Split (ModelInfer) calls begun whose message is not all in yet (see `receiving`): counted in `receiving_here`, or,
  // in a front-end process, in its int of memory the engine maps too (`start`'s counter), which the engine's batches
  // read. GCC's __atomic builtins on a plain int: what C++20's atomic_ref does, on memory two processes share.
  int receiving_here = 0;
  int* receiving_at = &receiving_here;
  Py_buffer counter{};  // the buffer receiving_at points into, held while the bridge lives (counter.obj: none)
  void CountReceiving(int change) { __atomic_add_fetch(receiving_at, change, __ATOMIC_RELAXED); }
  ~Bridge() {  // (with the GIL: in start, or the capsule's destructor)
    if (counter.obj != nullptr) PyBuffer_Release(&counter);
  }
  std::atomic<uint64_t> next_id{1};
  int efd = -1;

  std::mutex events_mu;
  std::deque<Event> events;

  std::recursive_mutex calls_mu;  // recursive: a grpc call made under it may run OnDone on this thread
  std::unordered_map<uint64_t, Call*> calls;

  bool TakeShared() {
    if (++active > max_calls) {
      --active;
      return false;
    }
    return true;
  }

  void push(Event&& event) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(events_mu);
      wake = events.empty();
      events.push_back(std::move(event));
    }
    if (wake) {
      uint64_t one = 1;
      ssize_t unused = write(efd, &one, sizeof one);
      (void)unused;  // a full counter still wakes the reader
    }
  }
};

// Which place a call holds. A unary call waits for its request message holding none of the shared ones: a call that
// sends its headers and never its message (anyone can, without the token) must not keep another client's calls out.
// Those are bounded per connection by HTTP/2's concurrent streams (grpc.max_concurrent_streams) and in time by
// `sweep` (--read-timeout); the message in, the call takes a shared place or is refused RESOURCE_EXHAUSTED.
enum class Slot { kNone, kShared };

class Call : public grpc::ServerGenericBidiReactor {
 public:
  Call(Bridge* bridge, grpc::GenericCallbackServerContext* context, Method method)
      : bridge_(bridge), context_(context), id_(bridge->next_id++), split_(method.split),
        slot_(method.stream ? Slot::kShared : Slot::kNone), created_(std::chrono::steady_clock::now()) {
    bool stream = method.stream;
    {
      std::lock_guard<std::recursive_mutex> lock(bridge->calls_mu);
      bridge->calls[id_] = this;
    }
    if (stream) {
      Announce(nullptr);
    } else {
      if (split_) {
        receiving_ = true;
        bridge->CountReceiving(1);
      }
      StartRead(&in_);  // the call is announced with its message
    }
  }

  // ---- asked for by Python (under calls_mu) ----
  // A stream's reads: `more` messages Python will take (credits). One read is in flight at a time; the next starts
  // as soon as one is done while credits are left, so that what a client sends together arrives together.
  void Read(int more) {
    credits_ += more;
    ReadOn();
  }
  // A stream's answers: one write in flight at a time, the others queued here in order (Python bounds how many:
  // native.WRITE_AHEAD a stream), so that the handler need not wait for each write; one written with more queued
  // behind it carries grpc's buffer hint, so that they may leave in one packet.
  void Write(grpc::ByteBuffer&& message) {
    if (writing_) {
      unwritten_.push_back(std::move(message));
      return;
    }
    writing_ = true;
    out_ = std::move(message);
    StartWrite(&out_);
  }
  void WriteAndFinish(grpc::ByteBuffer&& message) {
    if (!Claim()) return;
    out_ = std::move(message);
    StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void End(grpc::Status status) {  // under calls_mu
    if (!Claim()) return;
    if (writing_) {  // after the answers queued: OnWriteDone finishes
      ending_ = std::move(status);
      return;
    }
    Finish(std::move(status));
  }
  void AddMetadata(const std::string& key, const std::string& value) { context_->AddInitialMetadata(key, value); }
  bool finished() const { return finished_; }

  // ---- reactions, on grpc's threads ----
  void OnReadDone(bool ok) override {
    if (!announced_) {
      Received();
      if (!ok) {  // the client half-closed or went away before its one message, or `sweep` ended it: no answer
        std::lock_guard<std::recursive_mutex> lock(bridge_->calls_mu);
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the call ended before its request message"));
        return;
      }
      if (!bridge_->TakeShared()) {
        std::lock_guard<std::recursive_mutex> lock(bridge_->calls_mu);
        End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "the server has as many calls as it takes at once"));
        return;
      }
      slot_ = Slot::kShared;
      if (!finished_) Announce(&in_);  // (one cancelled meanwhile is ended already: no handler for it)
      return;
    }
    Event event{READ, id_, ok};
    event.split = split_;
    if (ok) {
      event.message.Swap(&in_);
      event.has_message = true;
    }
    bridge_->push(std::move(event));
    std::lock_guard<std::recursive_mutex> lock(bridge_->calls_mu);  // as Python's calls: never after the Finish
    reading_ = false;
    if (!ok) {
      read_over_ = true;  // the client's last message (or the call broke): nothing more to read
    } else {
      ReadOn();  // nothing of `this` after it
    }
  }
  // (StartWriteAndFinish has no OnWriteDone: this is always a stream's write, failed ones included.)
  void OnWriteDone(bool ok) override {
    bridge_->push(Event{WRITTEN, id_, ok});
    std::lock_guard<std::recursive_mutex> lock(bridge_->calls_mu);
    if (ok && !unwritten_.empty()) {
      out_ = std::move(unwritten_.front());
      unwritten_.pop_front();
      grpc::WriteOptions options;
      if (!unwritten_.empty()) options.set_buffer_hint();
      StartWrite(&out_, options);
      return;
    }
    unwritten_.clear();  // a failed write: the call is broken, the rest can't go
    writing_ = false;
    if (ending_) {
      grpc::Status status = std::move(*ending_);
      ending_.reset();
      Finish(std::move(status));  // nothing of `this` after it
    }
  }
  // Every call must be finished, a cancelled one too, or grpc never lets it go (and Shutdown waits for it for
  // ever). It is finished here, not left to its handler, which may never run (a call cancelled before its task
  // started) or may fail to: Python learns of it only to stop the handler.
  void OnCancel() override {
    bridge_->push(Event{CANCELLED, id_, false});
    std::lock_guard<std::recursive_mutex> lock(bridge_->calls_mu);
    End(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));  // nothing of `this` after it
  }
  void OnDone() override {
    Received();  // (one ended before its message: no OnReadDone)
    {
      std::lock_guard<std::recursive_mutex> lock(bridge_->calls_mu);
      bridge_->calls.erase(id_);
    }
    if (slot_ == Slot::kShared) bridge_->active--;
    delete this;
  }

  // (under calls_mu) A unary call still waiting for its request message `limit` after it began: ended, as an HTTP
  // request whose body does not come within --read-timeout. True when it was.
  bool EndIfWaitingSince(std::chrono::steady_clock::time_point limit) {
    if (announced_ || finished_ || created_ > limit) return false;
    End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "no request message within --read-timeout"));
    return true;
  }

 private:
  // The one caller that decides the call's status: Finish and StartWriteAndFinish may be called once, whoever comes
  // first (End may leave the Finish itself to OnWriteDone, after a stream's queued answers).
  bool Claim() { return !finished_.exchange(true); }
  void Received() {
    if (receiving_.exchange(false)) bridge_->CountReceiving(-1);
  }

  void ReadOn() {  // under calls_mu
    if (reading_ || read_over_ || credits_ <= 0 || finished_) return;
    reading_ = true;
    credits_--;
    StartRead(&in_);
  }

  void Announce(grpc::ByteBuffer* message) {
    announced_ = true;
    Event event{CALL, id_, true};
    event.split = split_;
    event.method = context_->method();
    event.peer = context_->peer();
    for (const auto& [key, value] : context_->client_metadata()) {
      event.metadata.emplace_back(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
    }
    if (message != nullptr) {
      event.message.Swap(message);
      event.has_message = true;
    }
    bridge_->push(std::move(event));
  }

  Bridge* bridge_;
  grpc::GenericCallbackServerContext* context_;
  const uint64_t id_;
  const bool split_;
  std::atomic<bool> announced_{false};  // (read by `sweep` on Python's thread)
  Slot slot_;                            // (changed on grpc's threads only: in OnReadDone, before OnDone)
  const std::chrono::steady_clock::time_point created_;
  bool reading_ = false;    // a stream's read in flight (under calls_mu)
  bool read_over_ = false;  // a stream's reads are over: its client half-closed, or the call broke
  bool writing_ = false;  // a stream's write in flight (under calls_mu)
  std::deque<grpc::ByteBuffer> unwritten_;  // answers queued behind it (under calls_mu)
  std::optional<grpc::Status> ending_;      // the status, once the queued answers are written (under calls_mu)
  int credits_ = 0;       // messages Python will still take (under calls_mu)
  std::atomic<bool> finished_{false};
  std::atomic<bool> receiving_{false};  // counted in bridge->receiving_at
  grpc::ByteBuffer in_;
  grpc::ByteBuffer out_;
};

// A call answered at once with a status, never shown to Python: past max_calls (RESOURCE_EXHAUSTED, as grpc.aio's
// maximum_concurrent_rpcs), or a method the service does not have (UNIMPLEMENTED, without waiting for a message).
class Refusal : public grpc::ServerGenericBidiReactor {
 public:
  explicit Refusal(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(Bridge* bridge) : bridge_(bridge) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    auto method = bridge_->methods.find(context->method());
    if (method == bridge_->methods.end()) {
      return new Refusal(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "Method not found!"));
    }
    // A stream is handed to Python at once: it takes its shared place now; a unary call once its message is in.
    if (method->second.stream && !bridge_->TakeShared()) {
      return new Refusal(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                      "the server has as many calls as it takes at once"));
    }
    return new Call(bridge_, context, method->second);  // (a Method: how its messages go)
  }

 private:
  Bridge* bridge_;
};

// ---- the module's functions ----

const char* kCapsule = "serving.grpc._native.Bridge";
// The option naming the bytes grpc's transport may hold for the whole server (read buffers, messages not yet whole).
const char* kMemoryQuota = "trainserve-memory-quota";

Bridge* bridge_of(PyObject* capsule) { return static_cast<Bridge*>(PyCapsule_GetPointer(capsule, kCapsule)); }

void destroy(PyObject* capsule) {
  Bridge* bridge = bridge_of(capsule);
  if (bridge == nullptr) return;
  // Never stopped (the process is ending): left to the exit. Its calls could only end through handlers on an event
  // loop that no longer runs, so waiting for them here would never return.
  if (bridge->server) return;
  close(bridge->efd);
  delete bridge;
}

// start(address, methods: {full name: mode (1: a stream, 2: split its messages)}, options: {name: int}, max_calls,
// counter=None) -> (bridge, eventfd); `counter`: a writable buffer of at least one aligned C int, where the calls
// still receiving their message are counted instead (a front end's, in memory its engine reads: `receiving`).
// OSError if the address cannot be bound.
PyObject* start(PyObject*, PyObject* args) {
  const char* address;
  PyObject* methods;
  PyObject* options;
  int max_calls;
  PyObject* counter = Py_None;
  if (!PyArg_ParseTuple(args, "sO!O!i|O", &address, &PyDict_Type, &methods, &PyDict_Type, &options, &max_calls,
                        &counter)) {
    return nullptr;
  }
  auto bridge = std::make_unique<Bridge>();
  bridge->max_calls = max_calls;
  if (counter != Py_None) {
    if (PyObject_GetBuffer(counter, &bridge->counter, PyBUF_WRITABLE) < 0) return nullptr;
    auto where = reinterpret_cast<uintptr_t>(bridge->counter.buf);
    if (bridge->counter.len < static_cast<Py_ssize_t>(sizeof(int)) || where % alignof(int) != 0) {
      PyErr_SetString(PyExc_ValueError, "the receiving counter must be a writable buffer of one aligned C int");
      return nullptr;
    }
    bridge->receiving_at = static_cast<int*>(bridge->counter.buf);
  }
  PyObject *key, *value;
  Py_ssize_t position = 0;
  while (PyDict_Next(methods, &position, &key, &value)) {
    const char* name = PyUnicode_AsUTF8(key);
    if (name == nullptr) return nullptr;
    long mode = PyLong_AsLong(value);  // 1: a stream; 2: split its messages (see Method)
    if (mode == -1 && PyErr_Occurred()) return nullptr;
    bridge->methods[name] = Method{(mode & 1) != 0, (mode & 2) != 0};
  }

  grpc::ServerBuilder builder;
  grpc::ResourceQuota quota("trainserve");
  position = 0;
  while (PyDict_Next(options, &position, &key, &value)) {
    const char* name = PyUnicode_AsUTF8(key);
    long number = PyLong_AsLong(value);
    if (name == nullptr || PyErr_Occurred()) return nullptr;
    if (std::strcmp(name, kMemoryQuota) == 0) {  // not a channel argument: the server's resource quota
      if (number > 0) builder.SetResourceQuota(quota.Resize(static_cast<size_t>(number)));
      continue;
    }
    if (number < INT_MIN || number > INT_MAX) {  // grpc's channel arguments are C ints: never wrapped silently
      PyErr_Format(PyExc_OverflowError, "grpc channel argument %s=%ld is outside a C int", name, number);
      return nullptr;
    }
    builder.AddChannelArgument(name, static_cast<int>(number));
  }
  bridge->service = std::make_unique<Service>(bridge.get());
  bridge->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (bridge->efd < 0) return PyErr_SetFromErrno(PyExc_OSError);
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(bridge->service.get());
  Py_BEGIN_ALLOW_THREADS bridge->server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS if (!bridge->server || port == 0) {
    close(bridge->efd);
    PyErr_Format(PyExc_OSError, "cannot serve gRPC on %s: the port is taken or the address is not this machine's",
                 address);
    return nullptr;
  }
  int efd = bridge->efd;
  PyObject* capsule = PyCapsule_New(bridge.release(), kCapsule, destroy);
  if (capsule == nullptr) return nullptr;
  return Py_BuildValue("(Ni)", capsule, efd);
}

// sweep(bridge, seconds) -> how many unary calls still waiting for their request message after `seconds` were ended
// (DEADLINE_EXCEEDED). Called by Python a few times a --read-timeout.
PyObject* sweep(PyObject*, PyObject* args) {
  PyObject* capsule;
  double seconds;
  if (!PyArg_ParseTuple(args, "Od", &capsule, &seconds)) return nullptr;
  Bridge* bridge = bridge_of(capsule);
  if (bridge == nullptr) return nullptr;
  long ended = 0;
  Py_BEGIN_ALLOW_THREADS {
    auto limit = std::chrono::steady_clock::now() -
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
    std::vector<uint64_t> ids;
    std::lock_guard<std::recursive_mutex> lock(bridge->calls_mu);
    for (const auto& entry : bridge->calls) ids.push_back(entry.first);
    for (uint64_t id : ids) {  // looked up again each: End may run OnDone here, which erases (and deletes) a call
      auto found = bridge->calls.find(id);
      if (found != bridge->calls.end() && found->second->EndIfWaitingSince(limit)) ended++;
    }
  }
  Py_END_ALLOW_THREADS return PyLong_FromLong(ended);
}

// ---- a ModelInferRequest split: its raw_input_contents kept here ----

const char* kRaw = "serving.grpc._native.Raw";
constexpr size_t kMaxFields = 4096;  // a message of more top-level fields is not split (Python's field count refuses it)

// A message's slices and where its raw_input_contents lie in them; owned by a capsule Python holds.
struct Raw {
  std::vector<grpc::Slice> slices;
  std::vector<std::pair<size_t, size_t>> spans;  // (offset in the message, length) of each raw_input_contents
};

// Reads a message across its slices, byte by byte where it must (tags, lengths), skipping over the rest.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {}
  size_t pos() const { return pos_; }
  bool Byte(uint8_t* b) {
    while (si_ < slices_.size() && off_ >= slices_[si_].size()) Next();
    if (si_ >= slices_.size()) return false;
    *b = slices_[si_].begin()[off_++];
    pos_++;
    return true;
  }
  bool Varint(uint64_t* value) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      result |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        *value = result;
        return true;
      }
    }
    return false;
  }
  bool Skip(uint64_t n) {
    while (n > 0) {
      if (si_ >= slices_.size()) return false;
      size_t k = std::min<uint64_t>(slices_[si_].size() - off_, n);
      off_ += k;
      pos_ += k;
      n -= k;
      if (off_ >= slices_[si_].size()) Next();
    }
    return true;
  }

 private:
  void Next() {
    si_++;
    off_ = 0;
  }
  const std::vector<grpc::Slice>& slices_;
  size_t si_ = 0, off_ = 0, pos_ = 0;
};

// Copies bytes start..start+length of the message (its slices) to `to`.
void CopyRange(const std::vector<grpc::Slice>& slices, size_t start, size_t length, char* to) {
  for (const auto& slice : slices) {
    if (length == 0) return;
    if (start >= slice.size()) {
      start -= slice.size();
      continue;
    }
    size_t k = std::min(slice.size() - start, length);
    memcpy(to, slice.begin() + start, k);
    to += k;
    length -= k;
    start = 0;
  }
}

// The message's top-level fields but raw_input_contents (field 7) into `rest`, those where they lie into `raw`;
// false for a message that is not well formed, or of more than kMaxFields fields (left whole to Python's parser and
// its field count, which say what is wrong). The fields between two raw contents are copied as one run.
bool Split(Raw* raw, size_t total, std::string* rest) {
  Cursor cursor(raw->slices);
  size_t run = 0, fields = 0;
  auto keep = [&](size_t end) {  // the run of other fields up to `end` into `rest`
    size_t at = rest->size();
    rest->resize(at + end - run);
    CopyRange(raw->slices, run, end - run, rest->data() + at);
  };
  while (cursor.pos() < total) {
    if (++fields > kMaxFields) return false;
    size_t field = cursor.pos();
    uint64_t tag, value;
    if (!cursor.Varint(&tag)) return false;
    switch (tag & 7) {
      case 0:
        if (!cursor.Varint(&value)) return false;
        break;
      case 1:
        if (!cursor.Skip(8)) return false;
        break;
      case 5:
        if (!cursor.Skip(4)) return false;
        break;
      case 2:
        if (!cursor.Varint(&value) || value > total - cursor.pos()) return false;
        if ((tag >> 3) == 7) {
          keep(field);
          raw->spans.emplace_back(cursor.pos(), value);
          if (!cursor.Skip(value)) return false;
          run = cursor.pos();
          continue;
        }
        if (!cursor.Skip(value)) return false;
        break;
      default:
        return false;  // groups, and wire types that do not exist
    }
  }
  keep(total);
  return true;
}

void DestroyRaw(PyObject* capsule) { delete static_cast<Raw*>(PyCapsule_GetPointer(capsule, kRaw)); }

PyObject* bytes_of(const grpc::ByteBuffer& buffer);

// A split method's message for Python: (the message without its raw_input_contents, a capsule holding them, their
// lengths), or the message's bytes when it can't be split.
PyObject* split_of(const grpc::ByteBuffer& buffer) {
  auto raw = std::make_unique<Raw>();
  std::string rest;
  if (!buffer.Dump(&raw->slices).ok() || !Split(raw.get(), buffer.Length(), &rest)) return bytes_of(buffer);
  PyObject* lengths = PyTuple_New(static_cast<Py_ssize_t>(raw->spans.size()));
  if (lengths == nullptr) return nullptr;
  for (size_t i = 0; i < raw->spans.size(); i++) {
    PyTuple_SET_ITEM(lengths, static_cast<Py_ssize_t>(i), PyLong_FromSize_t(raw->spans[i].second));
  }
  PyObject* capsule = PyCapsule_New(raw.get(), kRaw, DestroyRaw);
  if (capsule == nullptr) {
    Py_DECREF(lengths);
    return nullptr;
  }
  raw.release();
  return Py_BuildValue("(y#NN)", rest.data(), static_cast<Py_ssize_t>(rest.size()), capsule, lengths);
}

PyObject* message_of(const grpc::ByteBuffer& buffer, bool split) {
  return split ? split_of(buffer) : bytes_of(buffer);
}

// Whether every value of `width` bytes (2, 4, 8: IEEE floats) in `data` is finite: its exponent bits not all ones.
// Vectorized (a scalar loop cost 150 us for a 602 KB image): target_clones picks AVX-512 or AVX2 where the CPU has
// them, as serving/_ingest.c does.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3")))
#else
#define CLONES
#endif
#define ALL_FINITE(NAME, T, MASK)                                                           \
  CLONES bool NAME(const char* data, size_t size) {                                         \
    T bad = 0;                                                                              \
    const T* values = reinterpret_cast<const T*>(data);                                     \
    for (size_t i = 0, n = size / sizeof(T); i < n; i++) bad |= (T)((values[i] & (MASK)) == (MASK)); \
    return bad == 0;                                                                        \
  }
ALL_FINITE(AllFinite16, uint16_t, 0x7c00u)
ALL_FINITE(AllFinite32, uint32_t, 0x7f800000u)
ALL_FINITE(AllFinite64, uint64_t, 0x7ff0000000000000ull)

// copy_raw(raw, index, destination, width) -> whether every value is finite (width 0: not checked): raw_input_contents
// [index] copied into `destination` (a writable buffer of exactly its length), without the GIL.
PyObject* copy_raw(PyObject*, PyObject* args) {
  PyObject* capsule;
  Py_ssize_t index;
  Py_buffer destination;
  int width;
  if (!PyArg_ParseTuple(args, "Onw*i", &capsule, &index, &destination, &width)) return nullptr;
  Raw* raw = static_cast<Raw*>(PyCapsule_GetPointer(capsule, kRaw));
  bool fits = raw != nullptr && index >= 0 && static_cast<size_t>(index) < raw->spans.size() &&
              static_cast<size_t>(destination.len) == raw->spans[index].second;
  if (!fits || !(width == 0 || width == 2 || width == 4 || width == 8)) {
    PyBuffer_Release(&destination);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "copy_raw: no such raw_input_contents, or a destination "
                                                             "of another length");
    return nullptr;
  }
  bool finite = true;
  Py_BEGIN_ALLOW_THREADS
  char* to = static_cast<char*>(destination.buf);
  CopyRange(raw->slices, raw->spans[index].first, raw->spans[index].second, to);
  size_t size = raw->spans[index].second;
  if (width == 2) finite = AllFinite16(to, size);
  if (width == 4) finite = AllFinite32(to, size);
  if (width == 8) finite = AllFinite64(to, size);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&destination);
  return PyBool_FromLong(finite);
}

PyObject* bytes_of(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return PyBytes_FromStringAndSize("", 0);
  if (slices.size() == 1) {
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(slices[0].begin()), slices[0].size());
  }
  PyObject* bytes = PyBytes_FromStringAndSize(nullptr, buffer.Length());
  if (bytes == nullptr) return nullptr;
  char* at = PyBytes_AS_STRING(bytes);
  for (const auto& slice : slices) {
    memcpy(at, slice.begin(), slice.size());
    at += slice.size();
  }
  return bytes;
}

// Ends a call with INTERNAL, if it is not finished yet.
void fail(Bridge* bridge, uint64_t id, const char* why) {
  std::lock_guard<std::recursive_mutex> lock(bridge->calls_mu);
  auto found = bridge->calls.find(id);
  if (found != bridge->calls.end()) found->second->End(grpc::Status(grpc::StatusCode::INTERNAL, why));
}

// The CALL event as (CALL, call, method, ((key, value), ...), message bytes or None); nullptr on failure.
PyObject* call_item(Event& event) {
  PyObject* metadata = PyTuple_New(static_cast<Py_ssize_t>(event.metadata.size()));
  if (metadata == nullptr) return nullptr;
  Py_ssize_t j = 0;
  for (auto& [key, value] : event.metadata) {
    // binary (-bin) values are bytes, the rest text, as grpc.aio gives them; text that is not UTF-8 as bytes, which
    // the handlers leave out as a header none of them could read
    bool binary = key.size() > 4 && key.compare(key.size() - 4, 4, "-bin") == 0;
    PyObject* pair = binary ? Py_BuildValue("(s#y#)", key.data(), key.size(), value.data(), value.size())
                            : Py_BuildValue("(s#s#)", key.data(), key.size(), value.data(), value.size());
    if (pair == nullptr) {
      PyErr_Clear();
      pair = Py_BuildValue("(y#y#)", key.data(), key.size(), value.data(), value.size());
    }
    if (pair == nullptr) {
      Py_DECREF(metadata);
      return nullptr;
    }
    PyTuple_SET_ITEM(metadata, j++, pair);
  }
  PyObject* message = event.has_message ? message_of(event.message, event.split) : Py_NewRef(Py_None);
  // (the method is one of the names given at start, so text; "replace" all the same: no event is lost)
  PyObject* method = PyUnicode_DecodeUTF8(event.method.data(), event.method.size(), "replace");
  PyObject* peer = PyUnicode_DecodeUTF8(event.peer.data(), event.peer.size(), "replace");
  if (message == nullptr || method == nullptr || peer == nullptr) {
    Py_XDECREF(message);
    Py_XDECREF(method);
    Py_XDECREF(peer);
    Py_DECREF(metadata);
    return nullptr;
  }
  return Py_BuildValue("(iKNNNN)", CALL, event.call, method, metadata, message, peer);  // "N": taken, on failure too
}

// drain(bridge) -> [(kind, call, a, b, ...)]: CALL (method, ((key, value), ...), message bytes or None, peer); READ
// (bytes or None at the end of the client's messages, None); WRITTEN (ok, None); CANCELLED (False, None).
PyObject* drain(PyObject*, PyObject* capsule) {
  Bridge* bridge = bridge_of(capsule);
  if (bridge == nullptr) return nullptr;
  uint64_t count;
  ssize_t unused = read(bridge->efd, &count, sizeof count);
  (void)unused;
  std::deque<Event> events;
  {
    std::lock_guard<std::mutex> lock(bridge->events_mu);
    events.swap(bridge->events);
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(events.size()));
  if (list == nullptr) return nullptr;
  Py_ssize_t i = 0;
  for (auto& event : events) {
    PyObject* item = nullptr;
    switch (event.kind) {
      case CALL:
        item = call_item(event);
        break;
      case READ: {
        PyObject* message = event.ok ? message_of(event.message, event.split) : Py_NewRef(Py_None);
        item = Py_BuildValue("(iKNO)", READ, event.call, message, Py_None);
        break;
      }
      default:
        item = Py_BuildValue("(iKOO)", event.kind, event.call, event.ok ? Py_True : Py_False, Py_None);
    }
    if (item == nullptr) {  // out of memory: the call is ended here rather than every event of the batch lost
      PyErr_Clear();
      fail(bridge, event.call, "the server could not take the call in (out of memory)");
      item = Py_BuildValue("(iKOO)", CANCELLED, event.call, Py_False, Py_None);
      if (item == nullptr) {
        Py_DECREF(list);
        return nullptr;
      }
    }
    PyList_SET_ITEM(list, i++, item);
  }
  return list;
}

// Runs `what` on the call's reactor if grpc has not finished with it; False if it had. Without the GIL: grpc may
// do the write's work on this thread, and the engine's thread can run Python meanwhile (`what` touches no Python
// object).
template <typename What>
PyObject* on_call(PyObject* capsule, unsigned long long id, What what) {
  Bridge* bridge = bridge_of(capsule);
  if (bridge == nullptr) return nullptr;
  bool alive;
  Py_BEGIN_ALLOW_THREADS {
    std::lock_guard<std::recursive_mutex> lock(bridge->calls_mu);
    auto found = bridge->calls.find(id);
    alive = found != bridge->calls.end() && !found->second->finished();
    if (alive) what(found->second);
  }
  Py_END_ALLOW_THREADS return PyBool_FromLong(alive);
}

grpc::ByteBuffer buffer_of(const char* data, Py_ssize_t size) {
  grpc::Slice slice(data, static_cast<size_t>(size));
  return grpc::ByteBuffer(&slice, 1);
}

PyObject* start_read(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long id;
  int more;
  if (!PyArg_ParseTuple(args, "OKi", &capsule, &id, &more)) return nullptr;
  return on_call(capsule, id, [&](Call* call) { call->Read(more); });
}

// write(bridge, call, message, last): last=True sends the message with status OK, ending the call (a unary answer).
PyObject* write_message(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long id;
  const char* data;
  Py_ssize_t size;
  int last;
  if (!PyArg_ParseTuple(args, "OKy#p", &capsule, &id, &data, &size, &last)) return nullptr;
  grpc::ByteBuffer message = buffer_of(data, size);
  return on_call(capsule, id, [&](Call* call) {
    if (last) {
      call->WriteAndFinish(std::move(message));
    } else {
      call->Write(std::move(message));
    }
  });
}

PyObject* finish(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long id;
  int code;
  const char* details;
  Py_ssize_t size;
  if (!PyArg_ParseTuple(args, "OKis#", &capsule, &id, &code, &details, &size)) return nullptr;  // NULs and all
  grpc::Status status(static_cast<grpc::StatusCode>(code), std::string(details, static_cast<size_t>(size)));
  return on_call(capsule, id, [&](Call* call) { call->End(status); });
}

// What grpc's C++ core accepts as a text metadata pair (it treats anything else as a bug of the caller and aborts).
bool legal(const std::string& key, const std::string& value) {
  if (key.empty() || key[0] == ':') return false;
  for (unsigned char c : key) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '-' || c == '_' || c == '.')) return false;
  }
  if (key.size() > 4 && key.compare(key.size() - 4, 4, "-bin") == 0) return true;
  for (unsigned char c : value) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

// add_initial_metadata(bridge, call, ((key, value), ...)): the pairs go with the first message or the status.
PyObject* add_initial_metadata(PyObject*, PyObject* args) {
  PyObject* capsule;
  unsigned long long id;
  PyObject* pairs;
  if (!PyArg_ParseTuple(args, "OKO", &capsule, &id, &pairs)) return nullptr;
  std::vector<std::pair<std::string, std::string>> metadata;
  PyObject* iterator = PyObject_GetIter(pairs);
  if (iterator == nullptr) return nullptr;
  while (PyObject* pair = PyIter_Next(iterator)) {
    const char *key, *value;
    Py_ssize_t key_size, value_size;
    int parsed = PyArg_ParseTuple(pair, "s#s#", &key, &key_size, &value, &value_size);
    if (parsed) metadata.emplace_back(std::string(key, key_size), std::string(value, value_size));
    if (parsed && !legal(metadata.back().first, metadata.back().second)) {  // grpc aborts the process on these
      PyErr_Format(PyExc_ValueError, "not valid gRPC metadata (a lower-case key of [0-9a-z_.-], a value of "
                   "printable ASCII): %R", pair);
      parsed = 0;
    }
    Py_DECREF(pair);
    if (!parsed) break;
  }
  Py_DECREF(iterator);
  if (PyErr_Occurred()) return nullptr;
  return on_call(capsule, id, [&](Call* call) {
    for (const auto& [key, value] : metadata) call->AddMetadata(key, value);
  });
}

// stop(bridge, grace_s): no new calls; those in flight have grace_s to finish (the event loop must keep running:
// call it from another thread), then are cancelled. Returns when every call is done.
PyObject* stop(PyObject*, PyObject* args) {
  PyObject* capsule;
  double grace;
  if (!PyArg_ParseTuple(args, "Od", &capsule, &grace)) return nullptr;
  Bridge* bridge = bridge_of(capsule);
  if (bridge == nullptr) return nullptr;
  if (bridge->server) {
    auto deadline = std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<int64_t>(grace * 1e6));
    Py_BEGIN_ALLOW_THREADS bridge->server->Shutdown(deadline);
    bridge->server->Wait();
    Py_END_ALLOW_THREADS bridge->server.reset();
  }
  Py_RETURN_NONE;
}

// receiving(bridge) -> the ModelInfer calls whose message is on its way (begun, not all in): requests a batch may
// wait for, as for an HTTP body arriving (serving/batcher.py), though which model they are for is not known yet.
PyObject* receiving(PyObject*, PyObject* capsule) {
  Bridge* bridge = bridge_of(capsule);
  if (bridge == nullptr) return nullptr;
  return PyLong_FromLong(__atomic_load_n(bridge->receiving_at, __ATOMIC_RELAXED));
}

PyMethodDef methods[] = {
    {"start", start, METH_VARARGS, "start(address, methods, options, max_calls, counter=None) -> (bridge, eventfd)"},
    {"drain", drain, METH_O, "drain(bridge) -> [(kind, call, a, b, ...)]"},
    {"copy_raw", copy_raw, METH_VARARGS, "copy_raw(raw, index, destination, width) -> all finite"},
    {"start_read", start_read, METH_VARARGS, "start_read(bridge, call, more) -> bool"},
    {"write", write_message, METH_VARARGS, "write(bridge, call, message, last) -> bool"},
    {"finish", finish, METH_VARARGS, "finish(bridge, call, code, details) -> bool"},
    {"add_initial_metadata", add_initial_metadata, METH_VARARGS,
     "add_initial_metadata(bridge, call, pairs) -> bool"},
    {"stop", stop, METH_VARARGS, "stop(bridge, grace_s)"},
    {"sweep", sweep, METH_VARARGS, "sweep(bridge, seconds) -> calls ended for want of their message"},
    {"receiving", receiving, METH_O, "receiving(bridge) -> ModelInfer calls whose message is on its way"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "grpc's C++ server as the gRPC front end's transport",
                      -1, methods};

}  // namespace

// grpc's own log lines (its HTTP/2 parser's among them, which quote a malformed header's value: a client's bytes)
// one line each on stderr, control characters escaped: a value can't start a line that passes for the server's.
static void EscapedGrpcLog(gpr_log_func_args* args) {
  std::string line = std::string("grpc ") + gpr_log_severity_string(args->severity) + " " + args->file + ":" +
                     std::to_string(args->line) + ": ";
  for (const char* p = args->message; *p != '\0'; ++p) {
    unsigned char c = static_cast<unsigned char>(*p);
    if ((c < 0x20 && c != '\t') || c == 0x7f) {
      char escaped[5];
      snprintf(escaped, sizeof escaped, "\\x%02x", c);
      line += escaped;
    } else {
      line += static_cast<char>(c);
    }
  }
  line += "\n";
  fwrite(line.data(), 1, line.size(), stderr);
}

PyMODINIT_FUNC PyInit__native() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  gpr_set_log_function(EscapedGrpcLog);
  PyModule_AddIntConstant(m, "CALL", CALL);
  PyModule_AddIntConstant(m, "READ", READ);
  PyModule_AddIntConstant(m, "WRITTEN", WRITTEN);
  PyModule_AddIntConstant(m, "CANCELLED", CANCELLED);
  return m;
}
