#ifndef SHARDSERVE_SERVER_WORKER_COMPLETION_TAG_H_
#define SHARDSERVE_SERVER_WORKER_COMPLETION_TAG_H_

namespace shardserve::server {

// What a tag on a completion queue that one thread drains points at: that thread calls Proceed
// with the operation's `ok`.
struct CompletionTag {
  virtual ~CompletionTag() = default;
  virtual void Proceed(bool ok) = 0;
};

// A tag that calls a member function of `T` (for objects with several operations in flight).
template <typename T>
struct MemberTag final : CompletionTag {
  MemberTag(T* object, void (T::*fn)(bool)) : object(object), fn(fn) {}
  void Proceed(bool ok) override { (object->*fn)(ok); }
  T* object;
  void (T::*fn)(bool);
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_WORKER_COMPLETION_TAG_H_
